"""Generated gRPC modules for the routing feed (protos/sentinel/routing/v1); regenerate with
``python scripts/gen_protos.py``."""
