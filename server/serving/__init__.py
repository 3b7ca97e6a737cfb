"""Serving and leases: generations, leases, build jobs, who is asking and what each op may do."""
