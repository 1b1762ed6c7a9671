"""World rehearsal: self-unfolded rollouts (ACT / REHEARSE / USER in lockstep) and test-time private rehearsal."""
