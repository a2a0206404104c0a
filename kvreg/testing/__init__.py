"""Test helpers shared by kvreg's tests, the conformance suite and the reports:
seeded data generators and slow float64 oracles."""
