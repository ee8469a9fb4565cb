/* A minimal NVTX v3 tool: what Nsight Systems would see, written to a text file.
 *
 * The NVTX loader compiled into every NVTX user (here the `nvtx` Python package) calls
 * InitializeInjectionNvtx2 on the process's first NVTX call when NVTX_INJECTION64_PATH names this
 * library. We fill the CORE (domain-less) and CORE2 (domain) callback slots we care about; NVTX
 * turns every other call into a no-op. With NVTX_INJECTION_RECORD=FILE each event becomes a line:
 *
 *   init
 *   domain <TAB> NAME
 *   push <TAB> TID <TAB> DOMAIN <TAB> MESSAGE      (DOMAIN is empty for the default domain)
 *   pop <TAB> TID <TAB> DOMAIN
 *   mark <TAB> TID <TAB> DOMAIN <TAB> MESSAGE
 *
 * Without it the tool only counts events, which makes it a near-free stand-in for a profiler when
 * measuring the host cost of ranges.
 *
 * Build: cc -shared -fPIC -O2 -I<dir holding nvtx3/> nvtx_injection.c -o libnvtx_injection.so
 */
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Our handles: NVTX treats domain and string handles as opaque pointers owned by the tool. */
struct nvtxDomainRegistration_st { char *name; };
struct nvtxStringRegistration_st { char *text; };

static FILE *record;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long event_count;

static long thread_id(void) { return (long)syscall(SYS_gettid); }

static const char *domain_name(nvtxDomainHandle_t domain) {
    return domain ? domain->name : "";
}

static const char *message_of(const nvtxEventAttributes_t *attr) {
    if (attr == NULL) return "";
    switch (attr->messageType) {
    case NVTX_MESSAGE_TYPE_ASCII: return attr->message.ascii ? attr->message.ascii : "";
    case NVTX_MESSAGE_TYPE_REGISTERED:
        return attr->message.registered ? attr->message.registered->text : "";
    default: return "";  /* unicode and empty messages are not used by graphrt */
    }
}

/* One line per event, flushed at once so a crashing or os._exit-ing process still leaves a record. */
static void emit(const char *kind, nvtxDomainHandle_t domain, const char *message, int with_message) {
    pthread_mutex_lock(&lock);
    event_count++;
    if (record) {
        if (with_message)
            fprintf(record, "%s\t%ld\t%s\t%s\n", kind, thread_id(), domain_name(domain), message);
        else
            fprintf(record, "%s\t%ld\t%s\n", kind, thread_id(), domain_name(domain));
        fflush(record);
    }
    pthread_mutex_unlock(&lock);
}

static nvtxDomainHandle_t NVTX_API domain_create(const char *name) {
    nvtxDomainHandle_t domain = calloc(1, sizeof(*domain));
    domain->name = strdup(name ? name : "");
    pthread_mutex_lock(&lock);
    if (record) {
        fprintf(record, "domain\t%s\n", domain->name);
        fflush(record);
    }
    pthread_mutex_unlock(&lock);
    return domain;
}

/* Handles stay valid for the process's lifetime: a late pop may still name the domain. */
static void NVTX_API domain_destroy(nvtxDomainHandle_t domain) { (void)domain; }

static nvtxStringHandle_t NVTX_API register_string(nvtxDomainHandle_t domain, const char *text) {
    (void)domain;
    nvtxStringHandle_t handle = calloc(1, sizeof(*handle));
    handle->text = strdup(text ? text : "");
    return handle;
}

static int NVTX_API domain_push(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attr) {
    emit("push", domain, message_of(attr), 1);
    return 0;
}

static int NVTX_API domain_pop(nvtxDomainHandle_t domain) {
    emit("pop", domain, NULL, 0);
    return 0;
}

static void NVTX_API domain_mark(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attr) {
    emit("mark", domain, message_of(attr), 1);
}

static int NVTX_API push_ex(const nvtxEventAttributes_t *attr) { return domain_push(NULL, attr); }
static int NVTX_API push_a(const char *message) { emit("push", NULL, message ? message : "", 1); return 0; }
static int NVTX_API pop(void) { return domain_pop(NULL); }
static void NVTX_API mark_ex(const nvtxEventAttributes_t *attr) { domain_mark(NULL, attr); }
static void NVTX_API mark_a(const char *message) { emit("mark", NULL, message ? message : "", 1); }

static int set_slot(NvtxGetExportTableFunc_t get_export_table, NvtxCallbackModule module,
                    unsigned int id, NvtxFunctionPointer fn) {
    const NvtxExportTableCallbacks *callbacks = get_export_table(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!callbacks || !callbacks->GetModuleFunctionTable(module, &table, &size) || !table || id >= size)
        return 0;
    *table[id] = fn;
    return 1;
}

#define SLOT(module, id, fn) ok &= set_slot(get_export_table, module, id, (NvtxFunctionPointer)(fn))

NVTX_DECLSPEC int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const char *path = getenv("NVTX_INJECTION_RECORD");
    int ok = 1;
    if (path && *path) {
        record = fopen(path, "a");
        if (!record) return 0;  /* refusing makes NVTX fall back to no-ops, which the tests notice */
        fprintf(record, "init\n");
        fflush(record);
    }
    SLOT(NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_MarkEx, mark_ex);
    SLOT(NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_MarkA, mark_a);
    SLOT(NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushEx, push_ex);
    SLOT(NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushA, push_a);
    SLOT(NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePop, pop);
    SLOT(NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainMarkEx, domain_mark);
    SLOT(NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePushEx, domain_push);
    SLOT(NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePop, domain_pop);
    SLOT(NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRegisterStringA, register_string);
    SLOT(NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainCreateA, domain_create);
    SLOT(NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainDestroy, domain_destroy);
    return ok;
}

/* For the overhead benchmark: how many push/pop/mark events reached the tool. */
NVTX_DECLSPEC unsigned long long NVTX_API nvtx_injection_event_count(void) { return event_count; }
