"""Process wiring only: the command-line parser and one handler per subcommand, the embedded server,
the local Prometheus, the demo, and the Prometheus metrics object handed to the services.
"""
