"""The cluster-scale simulator: ``cpbench simulate`` (see ``model`` for the assumptions)."""
