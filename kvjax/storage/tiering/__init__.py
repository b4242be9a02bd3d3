"""The tiers: their configuration, the host tier, the placement policy and planner, the tiered
store, its ledger and its mover."""
