"""ref_server.py: reference logprobs, the bounded batch queue and the worker registry.

    python ref_server.py [--config F] [--set k=v] [--host H] [--port P]
    python ref_server.py --replica-of URL [--replica-id ID] [--config F] [--set k=v]

Gen workers upload scored groups; the learner pulls batches carrying reference logprobs. With
grpo.beta = 0 no reference model is loaded and samples pass straight through. With --replica-of, a
reference replica: no server, it computes reference logprobs for the server at URL (more GPUs for
the reference forward; toolrl/refserver/replicas.py). See docs/REF_SERVER.md.
"""
from toolrl.refserver.main import main

if __name__ == "__main__":
    main()
