"""``dmuon.Muon`` and what its ``step()`` uses: the pre-step checks, the NS hook, telemetry."""
