"""Settings: the command line, the config file, tenants (API keys) and logging."""
