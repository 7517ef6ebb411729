# Filled by the tenancy/durability/metrics promise tests (issue 28).
# promises_tenancy_test.py: tenants isolated across a dir: restart and from sessions made
# before keys; the unauthenticated, tenant and store-error metrics on a live server (and
# the FwserveSessionStoreErrors rule on that series); Redis kill -9 with appendfsync
# always keeps every acknowledged commit; the quotas (token-bucket refill, queued streams
# in max_streams, Import at max_sessions, a tenant's half of the queue); keys and prompts
# never logged. Each case takes 1 to 10 s (the token bucket waits for its refill).
# Every case can be turned red on purpose: promises_tenancy_test.py --break NAME.
foreach(case tenant_isolation_survives_restart sessions_before_keys_invisible
             refused_and_tenant_metrics store_errors_metric_and_alert
             redis_kill9_keeps_acknowledged_commits token_bucket_refills
             queued_streams_count_toward_max_streams import_at_max_sessions
             tenant_queue_share keys_and_prompts_never_logged)
  fwserve_add_process_test(promises_tenancy_${case} promises_tenancy_test.py
                           PromisesTenancyTest.test_${case})
  set_tests_properties(promises_tenancy_${case} PROPERTIES TIMEOUT 120)
endforeach()
