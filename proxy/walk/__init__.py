"""One request's walk: validation, the prefill hop, the decode hop, aborts and clean-up, the full answer."""
