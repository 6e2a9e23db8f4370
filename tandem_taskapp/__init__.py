"""Tandem's Task App SDK: write an environment as a few functions and serve it over the Task App HTTP
contract (docs/taskapp-openapi.yaml). The package is `tandem_taskapp` because `tandem.taskapp` is the
generated protobuf package of the taskapp-proxy contract."""
