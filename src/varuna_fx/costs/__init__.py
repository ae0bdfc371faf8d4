"""Time and memory estimates of graph nodes and stages (roofline, memory model)."""
