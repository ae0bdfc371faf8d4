"""Building a model without paying for its initialisers."""
