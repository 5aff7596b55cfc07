"""One module per subcommand: ``add_parser(sub)`` registers it, ``run(args)`` does it.

These modules must not import JAX at module level: the CLI builds every parser before ``--devices``
sets ``XLA_FLAGS``. ``run`` calls ``meshlm.cli.setup(args)`` first, then imports what it needs.
"""
