"""gen_worker.py: vLLM rollouts with the Python tool loop, scored and uploaded, with live weight updates.

    python gen_worker.py --config configs/cpu_demo.yaml [--set executor.url=...]
    python gen_worker.py --config CFG --rollout-only --num-prompts N --out FILE.jsonl

As a service it registers with the reference server, uploads scored groups (waiting when the
server is full) and serves POST /update_weights, GET /health and GET /stats. With --rollout-only
it writes scored samples to a JSONL file and needs no reference server.
"""
from toolrl.worker.main import main

if __name__ == "__main__":
    main()
