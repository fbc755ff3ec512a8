"""xds_server: the control plane."""
