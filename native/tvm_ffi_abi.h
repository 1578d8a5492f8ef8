/* The part of the TVM FFI C ABI (apache-tvm-ffi 0.1.x, tvm/ffi/c_api.h + dlpack.h) that the
 * native DSpark draft-chain traversal uses to call xgrammar's GrammarMatcher methods.
 *
 * Vendored (not #included from the installed apache-tvm-ffi) so the package builds without
 * apache-tvm-ffi in the build environment. The layouts are the stable C ABI of TVM FFI 0.1;
 * draft_traverse.c refuses any other ABI major/minor at bind time, and
 * tests/dspark_masks/test_native_traversal.py compiles this header against the installed
 * c_api.h and checks every size and offset used here.
 */
#ifndef DSPARK_TVM_FFI_ABI_H
#define DSPARK_TVM_FFI_ABI_H

#include <stddef.h>
#include <stdint.h>

#define DSH_TVM_FFI_ABI_MAJOR 0
#define DSH_TVM_FFI_ABI_MINOR 1

/* dlpack */
typedef struct {
    int32_t device_type; /* kDLCPU = 1 */
    int32_t device_id;
} dsh_DLDevice;

typedef struct {
    uint8_t code; /* kDLInt = 0 */
    uint8_t bits;
    uint16_t lanes;
} dsh_DLDataType;

typedef struct {
    void *data;
    dsh_DLDevice device;
    int32_t ndim;
    dsh_DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} dsh_DLTensor;

/* tvm ffi */
typedef struct {
    uint32_t major, minor, patch;
} dsh_TVMFFIVersion;

enum {
    dsh_kTVMFFINone = 0,
    dsh_kTVMFFIInt = 1,
    dsh_kTVMFFIBool = 2,
    dsh_kTVMFFIFloat = 3,
    dsh_kTVMFFIDLTensorPtr = 7,
    dsh_kTVMFFIStaticObjectBegin = 64,
    dsh_kTVMFFIError = 67,
    dsh_kTVMFFIFunction = 68
};

typedef struct {
    uint64_t combined_ref_count;
    int32_t type_index;
    uint32_t padding;
    void (*deleter)(void *self, int flags);
} dsh_TVMFFIObject;

typedef struct {
    int32_t type_index;
    uint32_t zero_padding;
    union {
        int64_t v_int64;
        double v_float64;
        void *v_ptr;
        dsh_TVMFFIObject *v_obj;
    };
} dsh_TVMFFIAny;

typedef struct {
    const char *data;
    size_t size;
} dsh_TVMFFIByteArray;

typedef struct {
    dsh_TVMFFIByteArray kind;
    dsh_TVMFFIByteArray message;
    /* more fields follow; not used */
} dsh_TVMFFIErrorCellPrefix;

typedef struct {
    dsh_TVMFFIByteArray name;
    dsh_TVMFFIByteArray doc;
    dsh_TVMFFIByteArray metadata;
    int64_t flags;
    dsh_TVMFFIAny method;
} dsh_TVMFFIMethodInfo;

typedef struct dsh_TVMFFITypeInfo {
    int32_t type_index;
    int32_t type_depth;
    dsh_TVMFFIByteArray type_key;
    const struct dsh_TVMFFITypeInfo **type_ancestors;
    uint64_t type_key_hash;
    int32_t num_fields;
    int32_t num_methods;
    const void *fields;
    const dsh_TVMFFIMethodInfo *methods;
    const void *metadata;
} dsh_TVMFFITypeInfo;

typedef void (*dsh_TVMFFIGetVersion_t)(dsh_TVMFFIVersion *out);
typedef int (*dsh_TVMFFIFunctionCall_t)(void *func, dsh_TVMFFIAny *args, int32_t num_args, dsh_TVMFFIAny *result);
typedef const dsh_TVMFFITypeInfo *(*dsh_TVMFFIGetTypeInfo_t)(int32_t type_index);
typedef void (*dsh_TVMFFIErrorMoveFromRaised_t)(void **result);
typedef int (*dsh_TVMFFIObjectDecRef_t)(void *obj);

#endif
