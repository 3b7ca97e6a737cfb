"""The daemon: its config, the request loop, the service that joins the stages, reader ops and metrics."""
