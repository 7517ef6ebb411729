# Documented promises about flags, fwctl and memory pressure (issue 28).
# promises_flags_test.py: memory pressure while sessions are unsaved (a failing dir:
# store and a budget of 3 states: RESOURCE_EXHAUSTED, no session deleted); fwctl's key
# sources, their precedence, the plaintext-key refusal off loopback, TLS and mutual TLS
# (x509-cn:), and the README's keyed quickstart run as written; the observable effect
# of --tls-*, --session-key-file (sealed exports), --session-dir, --session-store-threads, --prefill-threads,
# --batch-wait, --max-streams-per-connection, --grpc-memory-quota-bytes, --log-level and
# the 64 MiB message cap, and the start-up refusal of their bad values. Each case is a
# few seconds (the longest, the quickstart and the sealed exports, about 5 s); each can
# be turned red on purpose with --break NAME (see the script).
# fwctl_unreadable_key_file_exits_1 fails: fwctl exits 2, not the documented 1, when
# --api-key-file cannot be read (docs/client.md "Exit codes").
foreach(case memory_pressure_keeps_unsaved_sessions
             fwctl_key_sources fwctl_unreadable_key_file_exits_1
             fwctl_plaintext_key_refused_off_loopback fwctl_tls_and_mutual_tls
             readme_keyed_quickstart
             tls_flags session_key_file_seals_exports session_dir_alias
             session_store_threads prefill_threads batch_wait max_streams_per_connection
             grpc_memory_quota_bytes log_level message_size_cap)
  fwserve_add_process_test(promises_flags_${case} promises_flags_test.py
                           PromisesFlagsTest.test_${case} --fwctl $<TARGET_FILE:fwctl>)
  set_tests_properties(promises_flags_${case} PROPERTIES TIMEOUT 120)
endforeach()
