"""Admin HTTP endpoint."""
