"""Post-training (K3_SPEC section 8): environments, SFT, RL with budget tiers and partial rollouts, MOPD."""
