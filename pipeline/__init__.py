"""The batch job: manifests, planning, local and Ray runners, result store, A/B reports, CLI."""
