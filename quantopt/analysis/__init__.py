"""Analysis of a quantized graph against its float graph: per-layer similarity and the per-layer JSON template."""
