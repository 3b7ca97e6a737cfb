"""The loader daemon: checkpoint reader, expert layout, shared-memory arena, control server, CLI; offline tools in
`tools`."""
