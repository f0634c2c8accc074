"""Fixtures that run pd-sim workers on loopback (filled in by the pd-sim work)."""
