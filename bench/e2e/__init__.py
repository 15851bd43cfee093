"""End-to-end benchmark: kvroute and the peer routers, real processes, one simulated fleet."""
