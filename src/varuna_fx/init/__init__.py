"""Building a model without paying for its initialisers: ``skip_init`` (resume from a
checkpoint) and ``deferred_init`` (record on meta, replay per stage: record, replay,
materialize)."""
