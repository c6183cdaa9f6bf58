"""One client for both servers: replay the course's W1 trace over HTTP against
``python -m pagedkv_lab.serve`` and/or ``vllm serve``, side by side.

Each ``--url`` is replayed in turn with the same requests and Poisson arrivals
(the W1 requests of ``python -m pagedkv_lab.bench serve``, as token ids, greedy,
EOS ignored), and the table prints requests/s, output tokens/s and TTFT, TPOT
and end-to-end percentiles per server, with how many requests got the same
tokens as the first server. The client is `pagedkv_lab.bench.online`;
``python -m pagedkv_lab.bench online`` also starts the servers.

    python -m pagedkv_lab.serve small-llama --port 8000 ...      # see book/serving.md
    vllm serve ./small-llama-hf --port 8001 ...                  # see book/vllm.md
    python scripts/vllm_client.py --url http://localhost:8000 http://localhost:8001 \\
        --name pagedkv vllm --rate 1 2 4 inf --out w1.json
    python scripts/vllm_client.py --dry-run                      # the trace only
"""

from pagedkv_lab.bench.online import client_main

if __name__ == "__main__":
    client_main()
