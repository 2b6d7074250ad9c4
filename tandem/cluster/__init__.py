"""The cluster on Ray: worker pools as actors, a controller that scales each pool, an SLO
autoscaler that tells it how."""
