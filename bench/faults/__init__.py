"""Faults of kvroute's control channels under steady load, on ``kvroute up``'s fleet."""
