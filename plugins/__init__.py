"""Built-in dataset and metric plugins, loaded through the same discovery as user plugins."""
