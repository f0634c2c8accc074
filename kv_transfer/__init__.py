"""Everything about the P->D hand-off: launch-time connector configs (``config``) and the KV-lease ledger."""
