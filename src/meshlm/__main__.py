try:
    from meshlm.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the CLI: one line, as everywhere after
    import sys

    print("meshlm: SIGINT: stopped", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
