"""kvruntime: what every kvroute process runs with, beside the pure core.

The JSON log format, the garbage collector's thresholds, background-task ownership, the
NATS subscription probe, the command line built from a settings class and a server's
life from its settings to SIGTERM. It may use asyncio, NATS and logging but imports no
component (an import-linter contract keeps it so): a piece two components both need
lives here once, not twice.
"""
