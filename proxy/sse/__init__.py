"""Stream vocabulary: server-sent events, the relay's buffers, and the first token taken from P's answer."""
