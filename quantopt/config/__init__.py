"""Configuration: the declarative field table, the [Common] reader and the per-layer value grammar."""
