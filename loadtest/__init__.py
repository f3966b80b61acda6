"""Load tests for Triton LLM models (vLLM-backend conventions): Locust users, a headless runner, reports.

Never import loadtest.locustfile in-process: importing locust monkey-patches the process with gevent.
`python -m loadtest.run` runs Locust as a subprocess.
"""
