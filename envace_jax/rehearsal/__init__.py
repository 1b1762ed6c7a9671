"""World rehearsal: self-unfolded rollouts (ACT / REHEARSE / USER, one policy) and test-time private rehearsal."""
