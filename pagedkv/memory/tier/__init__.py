"""The second KV tier (host RAM or disk): its bookkeeping (no torch) and its bytes."""
