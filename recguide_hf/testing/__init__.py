"""Stand-ins for tests and device checks: a tiny NLD-shaped model (`nld_standin`) with NLD's attribute layout and
remote-code behaviour, so the NLD adapter is exercised without NLD's weights."""
