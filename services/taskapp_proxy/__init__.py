"""Task App proxy: registered Task Apps and authenticated rollout calls to them."""
