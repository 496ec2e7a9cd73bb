"""AOT generator: compiles the Triton (and FlyDSL) kernels per specialization into HSACO / cubin blobs
with a manifest (installed as ``ultraquant.codegen``)."""
