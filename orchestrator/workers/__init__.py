"""Workers: the plain server classes a stage or a drafter runs (Ray wraps them in orchestrator.cluster)."""
