"""``kvroute bench chaos``: every kind of fault under steady load on ``kvroute up``'s
fleet, and a soak, each measured against its target."""
