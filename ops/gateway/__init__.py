"""The capturing OpenAI-compatible gateway (``rollq gateway``): ``ops.gateway.app.create_app``
serves ``producers.inference.capture.CaptureHub`` over HTTP in front of the vLLM servers;
``ops.settings.GatewaySettings`` configures it."""
