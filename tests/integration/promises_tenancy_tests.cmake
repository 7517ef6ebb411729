# Filled by the tenancy/durability/metrics promise tests (issue 28).
