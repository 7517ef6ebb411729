# Filled by the flags/fwctl/memory promise tests (issue 28).
