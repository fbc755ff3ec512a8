"""xDS serving: resources, snapshot cache, ADS servicers."""
