"""Helpers shared by several test modules (test modules never import each other).

* :mod:`~tests.helpers.cli` — running the CLI and checking one-line errors;
* :mod:`~tests.helpers.cache` — request streams and multi-turn traces for cache tests;
* :mod:`~tests.helpers.fake_nvmet` — a simulated nvmet configfs tree;
* :mod:`~tests.helpers.secret_search` — searching a run's outputs and files for DH-HMAC-CHAP secrets;
* :mod:`~tests.helpers.spdk_peer`, :mod:`~tests.helpers.spdk_schema` — an SPDK JSON-RPC peer;
* :mod:`~tests.helpers.qemu_guest` — the QEMU kernel guest fixtures (a pytest plugin);
* :mod:`~tests.helpers.guest_nvme` — the guest kernel's NVMe/TCP host (nvme connect, hashes);
* :mod:`~tests.helpers.spdk_fixtures` — SPDK built from ../shared/vendor: ``spdk``,
  ``spdk_app``, ``nvmf_tgt`` (a pytest plugin);
* :mod:`~tests.helpers.powerloss` — an I/O engine that loses unflushed writes.
* :mod:`~tests.helpers.vllm_oracle` — vLLM's own v1 KV cache manager, loaded without torch
  (the oracle of tests/serving/test_kvpool_vllm.py), and a request for ``KVPool``.
"""
