"""The public face of Tandem: the gateway service and the `tandem` command line."""
