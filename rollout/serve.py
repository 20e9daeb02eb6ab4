"""`python -m rollout.serve ...`: the OpenAI-compatible server (rollout/server.py) under the name
the docs use. See `python -m rollout.serve --help`."""

from rollout.server import main

if __name__ == "__main__":
    main()
