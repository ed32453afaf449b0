"""Peer engines for `python -m realexec bench throughput --peer ...`.

- `vllm_runner.py`: a script run by vLLM's own interpreter (imports only vllm and the
  stdlib; never imported by twinserve): requests JSON in, timings JSON out.
- `llama_server.py`: a stdlib HTTP client timing a running llama.cpp `llama-server`.
The orchestration (workload, subprocess, ratio table) is `realexec.bench.peer_table`.
"""
