"""The streamed answer: reading D's stream, relaying it, the first token from P, migration on failure."""
