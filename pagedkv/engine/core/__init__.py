"""The control plane: scheduler, plan, fairness, headroom, KV reservations, tier link."""
