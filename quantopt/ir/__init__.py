"""Compass IR: dtypes, the text value grammar, the reader and the writer."""
